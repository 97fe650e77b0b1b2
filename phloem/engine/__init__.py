"""phloem.engine"""
