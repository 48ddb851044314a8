"""Task generators: contexts with questions whose answers are known."""
