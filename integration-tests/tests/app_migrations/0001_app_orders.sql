-- An application's own migration, kept in public with sqlx's default bookkeeping table.
CREATE TABLE public.orders (id bigint PRIMARY KEY, customer text NOT NULL);
