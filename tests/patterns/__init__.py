"""Lightning user patterns, each trained without the package and with it, compared (issue 19)."""
