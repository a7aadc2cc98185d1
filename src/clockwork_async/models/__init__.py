"""Models on disk: the repository of model folders, what a model file says (`info`), the
profile cache and the generated demo models."""
