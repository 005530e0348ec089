"""minichat's terminal front end: the Textual app, the CLI and the benchmark client."""
