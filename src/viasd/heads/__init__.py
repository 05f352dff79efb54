"""Draft heads: small networks that draft from the target's own features (final hidden states), and their files."""
