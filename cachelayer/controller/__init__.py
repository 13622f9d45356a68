"""The controller (LMCache's controller API over registered cache engines) and the engine-side worker."""
