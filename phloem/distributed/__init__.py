"""phloem.distributed"""
