"""``python -m engram_client.cli``: the ``engram`` console script without installing it (the tests run it so)."""

from engram_client.cli import app

if __name__ == "__main__":
    app()
