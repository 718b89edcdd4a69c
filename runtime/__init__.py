"""ftkit.runtime: what ft-run loads and executes."""
