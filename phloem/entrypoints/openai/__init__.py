"""phloem.entrypoints.openai"""
