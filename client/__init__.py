"""What runs inside engine processes: worker and scheduler clients and the vLLM connector.

Light imports, no daemon code, no heavy work at import time.
"""
