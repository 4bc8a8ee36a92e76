"""What requests and answers look like: validation per API, response models, the OpenAPI document."""
