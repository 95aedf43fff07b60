"""Pipeline stages across peers: stage servers hold a span of the model's layers, trainers own
the data and route each microbatch through one replica of every stage (``node/pipeline/``)."""
