"""Models: registration (what a checkpoint is), its sources (file://, s3://, hf://) and the models a worker keeps loaded."""
