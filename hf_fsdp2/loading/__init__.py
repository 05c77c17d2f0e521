"""The model on the meta device and each rank's slices of its weights: skeleton, facts, reading."""
