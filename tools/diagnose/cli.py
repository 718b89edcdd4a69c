"""ft-diagnose (lands with its issue)."""

from ftkit.runtime.console import not_implemented

main = not_implemented("ft-diagnose")
