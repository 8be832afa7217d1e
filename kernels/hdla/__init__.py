from .naive import hdla_decay_factors, naive_hdla
