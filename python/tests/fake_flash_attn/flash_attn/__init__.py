"""Stand-in for the flash_attn package (python/tests/test_fa4_backend.py puts its parent folder on sys.path): only the
flash_attn.cute module below, which attnforge's fa4 backend imports."""
