"""`python -m viasd` runs the command line."""

from viasd.cli import app

app()
