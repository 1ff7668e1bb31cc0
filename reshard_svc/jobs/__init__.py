"""A conversion as a job: the torchrun worker (``python -m reshard_svc.worker``) and the
progress events rank 0 reports to a file or to the server."""
