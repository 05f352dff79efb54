"""The OpenAI-compatible HTTP server: `viasd serve` (command.py) and the app factory (app.py)."""
