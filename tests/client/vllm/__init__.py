"""Tests of the connector parts that vLLM's scheduler drives."""
