"""OpenAI-compatible HTTP server: `pagedmoe serve [MODEL]`."""
