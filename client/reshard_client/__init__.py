"""reshard_client: the HTTP client and the ``reshard`` command line."""
