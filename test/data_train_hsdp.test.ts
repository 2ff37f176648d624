// test/data_train.test.ts under HSDP 2 x 2 (4 ranks, ZeRO-2): prepared, blended, unequal shards
// train exactly as one process on the same global batches.
process.env.FLOTILLA_DATA_LAYOUT = 'hsdp';
await import('./data_train.test.js');
