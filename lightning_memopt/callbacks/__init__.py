"""Lightning callbacks: thin adapters over the plain-torch cores."""

__all__: list[str] = []
