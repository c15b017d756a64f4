"""Other engines run as benchmark peers, on the identical requests and settings, in their own
virtual environments (never in .venv): `tessera bench throughput --peer vllm`."""
