"""phloem.worker"""
