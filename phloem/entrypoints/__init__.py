"""phloem.entrypoints"""
