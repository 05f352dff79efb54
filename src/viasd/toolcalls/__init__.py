"""Tool calls in a model's output: which format a chat template asks the model to write them in, and parsing them
out of the text (whole, or as it streams)."""
