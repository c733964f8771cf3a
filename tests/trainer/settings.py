"""Settings shared by the end-to-end tests."""

ARGS = ("--batch", "8", "--context", "32", "--corpus-kib", "512")
"""The example's settings for every end-to-end test: small enough for two cores."""
