"""Data shipped with the package: the bundled demo session (see NOTICE.md)."""
