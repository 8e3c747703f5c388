"""A request's decoding policy and how a logits row becomes a token: params (SamplingParams), processors (the
ordered pipeline), sampler (Gumbel-max with counter-based noise from rng), grammar and structured (xgrammar
masks), stop (stop strings across token boundaries). It knows nothing of the engine that calls it."""
