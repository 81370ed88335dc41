// A client of larder's API as a JavaScript user writes it from the proto: grpc-js, the proto
// loaded at run time, an insecure channel to the address as given, no channel options.
// Prints one JSON line: the datasets listed and the sample ids of one epoch of a dataset.
//
//     node client.js unix:/run/larder/larder.sock DATASET BATCH_SIZE
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [address, dataset, batchSize] = process.argv.slice(2);
const definition = loader.loadSync(path.join(__dirname, "../../../proto/larder/v1/larder.proto"), {
  keepCase: true,
  longs: Number,
  defaults: true,
});
const larder = grpc.loadPackageDefinition(definition).larder.v1;
const client = new larder.Larder(address, grpc.credentials.createInsecure());

client.ListDatasets({}, (err, listed) => {
  if (err) {
    console.error(`ListDatasets: ${err.message}`);
    process.exit(1);
  }
  const ids = [];
  const stream = client.StreamBatches({ dataset, batch_size: Number(batchSize), seed: 1 });
  stream.on("data", (batch) => ids.push(...batch.sample_ids));
  stream.on("error", (e) => {
    console.error(`StreamBatches: ${e.message}`);
    process.exit(1);
  });
  stream.on("end", () => {
    console.log(JSON.stringify({ datasets: listed.datasets.map((d) => d.name), ids }));
    client.close();
  });
});
