"""The package version (one place: ``reshard_svc.__version__``, the CLI's and the
server's ``--version``)."""

__version__ = "0.1.0"
