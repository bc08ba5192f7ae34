-- Generated prior-preservation class images, recorded like checkpoints: keyed per lease
-- (jobs/<job_id>/class_images/<index>-e<epoch>.png), recorded only under the live lease and only
-- once the store held exactly the announced bytes. A later holder of the job is given these (the
-- newest epoch's per index, with their sha256) and nothing else a holder left in storage.
CREATE TABLE class_images (
    job_id       uuid NOT NULL REFERENCES jobs (job_id),
    image_index  integer NOT NULL,
    epoch        bigint NOT NULL,
    key          text NOT NULL,
    size_bytes   bigint NOT NULL,
    sha256       text NOT NULL,
    committed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, image_index, epoch)
);
