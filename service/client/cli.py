"""The `engram` command line (placeholder until the client lands)."""
import typer

app = typer.Typer()
