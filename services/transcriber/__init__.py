"""The Transcriber stage."""
