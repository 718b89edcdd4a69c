"""ft-run (lands with the runtime issue)."""

from ftkit.runtime.console import not_implemented

main = not_implemented("ft-run")
