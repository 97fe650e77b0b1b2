"""phloem.layers"""
