"""Training a draft head for a target on this machine: data the target writes itself, then the head's training."""
