"""ftkit.tools: one package per command, each thin over ftkit.runtime."""
