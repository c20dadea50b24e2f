"""The HTTP container: quart-trio on hypercorn."""
