"""Inference: SGLang engines for rollout, teacher and genrm, and the gateway that serves them."""
