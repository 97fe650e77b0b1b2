"""phloem.ops"""
