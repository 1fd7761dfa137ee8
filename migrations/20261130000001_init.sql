-- cifpool schema, version 1: bookkeeping shared by every part of the service.
-- Later migrations add the CIF pools and the notification queue.

-- One row per instance start, so ops can see which versions ran against this database.
CREATE TABLE service_starts (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at  timestamptz NOT NULL DEFAULT now(),
    version     text        NOT NULL,
    hostname    text        NOT NULL
);
