"""``python -m reshard_client.cli``."""

from reshard_client.cli import main

if __name__ == "__main__":
    main()
