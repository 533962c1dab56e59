"""The `lipcheck` subcommands, one module each: arguments -> library -> report (experiments/*.py run the same)."""
