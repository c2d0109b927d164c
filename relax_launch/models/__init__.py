"""Models: locate or build the model directories jobs and tests run on."""
