"""reshard_server: the FastAPI control plane that runs conversion jobs on torchrun workers."""
