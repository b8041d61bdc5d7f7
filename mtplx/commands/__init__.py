"""One module per ``mtplx`` subcommand."""
