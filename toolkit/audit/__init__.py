"""The audit of other engines' transcripts (`mode=audit`): read OpenAI-API, token-id and HF generate transcripts,
recompute every token with our float64 or HF reference, report the errors, the precision detector's verdict and
the distribution checks. Our own runs' replay, verify and compare are toolkit.reproduce."""
