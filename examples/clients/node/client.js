#!/usr/bin/env node
// A fedsaddle client process in JavaScript (Node.js), written from the wire contract alone:
// proto/fedsaddle.proto and docs/reference/client-arithmetic.md ("the arithmetic page" below).
// It hosts one or more clients of the built-in problem `linear_regression`, each reading its
// own .npz file as `fedsaddle client` does, and serves runs without gradient noise.
//
//   node client.js --coordinator HOST:PORT --clients 0,2-3 --data 'data/client-{i:03d}.npz'
//
// Exit status: 0 after the coordinator's DONE goodbye, 1 otherwise, 2 for a bad command line.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const zlib = require('zlib');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// ------------------------------------------------------------------------------ command line

const USAGE = `usage: node client.js --coordinator HOST:PORT --clients INDICES --data PATH... [options]

  --coordinator HOST:PORT    the coordinator's address
  --clients INDICES          the client indices this process hosts: 3, 0,2,5 or 0-4
  --data PATH                the clients' .npz files: one pattern with {i} or {i:03d},
                             or one --data per index, in the order of --clients
  --proto PATH               the contract (default: ../../../proto/fedsaddle.proto from this file)
  --name TEXT                a name for the coordinator's logs (default: host:pid and node's version)
  --connect-timeout SECONDS  how long to wait for the coordinator (default: 60)`;

function usageError(problem) {
  console.error(`${problem}\n\n${USAGE}`);
  process.exit(2);
}

function parseIndices(text) {
  const indices = [];
  for (const part of text.split(',')) {
    const range = /^(\d+)(?:-(\d+))?$/.exec(part.trim());
    if (!range) usageError(`--clients: '${part}' is neither an index nor a range like 0-4`);
    for (let i = Number(range[1]); i <= Number(range[2] ?? range[1]); i++) {
      if (indices.includes(i)) usageError(`--clients: index ${i} is given twice`);
      indices.push(i);
    }
  }
  return indices;
}

// Each index's file: the pattern's {i} or {i:03d} replaced by the index, or the files in order.
function dataFiles(given, indices) {
  if (given.length === 1 && given[0].includes('{')) {
    const pattern = given[0];
    const field = /\{i(?::0(\d+)d)?\}/g;
    if (pattern.replace(field, '').includes('{')) usageError(`--data: use only {i} or {i:0Nd} in '${pattern}'`);
    return indices.map((i) => pattern.replace(field, (_, width) => String(i).padStart(Number(width ?? 0), '0')));
  }
  if (given.length !== indices.length) {
    usageError(`--data: ${indices.length} clients need one pattern with {i} or ${indices.length} files`);
  }
  return given;
}

function parseCommandLine(argv) {
  const options = {
    data: [],
    proto: path.join(__dirname, '..', '..', '..', 'proto', 'fedsaddle.proto'),
    name: `${os.hostname()}:${process.pid} (node ${process.version})`,
    connectTimeout: 60,
  };
  for (let k = 0; k < argv.length; k++) {
    const flag = argv[k];
    if (flag === '--help' || flag === '-h') {
      console.log(USAGE);
      process.exit(0);
    }
    const value = argv[++k];
    if (value === undefined) usageError(`${flag} needs a value`);
    if (flag === '--coordinator') options.coordinator = value;
    else if (flag === '--clients') options.indices = parseIndices(value);
    else if (flag === '--data') options.data.push(value);
    else if (flag === '--proto') options.proto = value;
    else if (flag === '--name') options.name = value;
    else if (flag === '--connect-timeout') options.connectTimeout = Number(value);
    else usageError(`unknown argument ${flag}`);
  }
  if (!options.coordinator || !options.indices || !options.data.length) {
    usageError('--coordinator, --clients and --data are required');
  }
  if (!(options.connectTimeout > 0)) usageError('--connect-timeout: give a number of seconds > 0');
  if (!fs.existsSync(options.proto)) usageError(`--proto: no file ${options.proto}`);
  options.files = dataFiles(options.data, options.indices);
  return options;
}

// ------------------------------------------------------------------------------ .npz files
// An .npz is a zip archive of .npy files: numpy's savez stores them, savez_compressed deflates
// them. An .npy file is a magic string, a header (a Python dict literal: dtype, order, shape),
// then the entries. Archives over 4 GiB (zip64) are not read here.

const NPY_TYPES = { // dtype code: [DataView reader, bytes per entry]
  f8: ['getFloat64', 8], f4: ['getFloat32', 4], i8: ['getBigInt64', 8], u8: ['getBigUint64', 8],
  i4: ['getInt32', 4], u4: ['getUint32', 4], i2: ['getInt16', 2], u2: ['getUint16', 2],
  i1: ['getInt8', 1], u1: ['getUint8', 1], b1: ['getUint8', 1],
};

function readNpy(bytes, what) {
  if (bytes.toString('latin1', 0, 6) !== '\x93NUMPY') throw new Error(`${what} is not an .npy array`);
  const start = bytes[6] === 1 ? 10 : 12; // format 1.0 gives the header's length in 2 bytes, later ones in 4
  const end = start + (bytes[6] === 1 ? bytes.readUInt16LE(8) : bytes.readUInt32LE(8));
  const header = bytes.toString('latin1', start, end);
  const dtype = /'descr':\s*'[<|]([fiub][1248])'/.exec(header);
  const shape = /'shape':\s*\(([\d,\s]*)\)/.exec(header);
  if (!dtype || !shape || !NPY_TYPES[dtype[1]]) {
    throw new Error(`${what} holds ${header.trim()}: expected little-endian numbers`);
  }
  const dims = shape[1].split(',').filter((s) => s.trim()).map(Number);
  const count = dims.reduce((a, b) => a * b, 1);
  const [read, size] = NPY_TYPES[dtype[1]];
  const view = new DataView(bytes.buffer, bytes.byteOffset + end, count * size);
  const flat = new Float64Array(count);
  for (let k = 0; k < count; k++) flat[k] = Number(view[read](k * size, true));
  if (!/'fortran_order':\s*True/.test(header) || dims.length < 2) return { dims, values: flat };
  if (dims.length > 2) throw new Error(`${what}: a Fortran-ordered array of ${dims.length} dimensions`);
  const [rows, cols] = dims;
  const values = new Float64Array(count); // column-major to row-major
  for (let r = 0; r < rows; r++) for (let c = 0; c < cols; c++) values[r * cols + c] = flat[c * rows + r];
  return { dims, values };
}

function readNpz(file) {
  const zip = fs.readFileSync(file);
  const directoryEnd = zip.lastIndexOf(Buffer.from('PK\x05\x06', 'latin1'));
  if (directoryEnd < 0) throw new Error(`${file} is not an .npz file (no zip directory)`);
  const arrays = {};
  let entry = zip.readUInt32LE(directoryEnd + 16); // the central directory's first entry
  for (let left = zip.readUInt16LE(directoryEnd + 10); left > 0; left--) {
    if (zip.readUInt32LE(entry) !== 0x02014b50) throw new Error(`${file}: damaged zip directory`);
    const method = zip.readUInt16LE(entry + 10);
    const size = zip.readUInt32LE(entry + 20);
    const nameLength = zip.readUInt16LE(entry + 28);
    const local = zip.readUInt32LE(entry + 42); // where the entry's local header starts
    const name = zip.toString('utf8', entry + 46, entry + 46 + nameLength);
    if (size === 0xffffffff || local === 0xffffffff) throw new Error(`${file}: ${name} is in zip64 form`);
    if (method !== 0 && method !== 8) throw new Error(`${file}: ${name} is compressed by method ${method}`);
    const dataStart = local + 30 + zip.readUInt16LE(local + 26) + zip.readUInt16LE(local + 28);
    const stored = zip.subarray(dataStart, dataStart + size);
    const bytes = method === 8 ? zlib.inflateRawSync(stored) : stored;
    arrays[name.replace(/\.npy$/, '')] = readNpy(bytes, `${file}: ${name}`);
    entry += 46 + nameLength + zip.readUInt16LE(entry + 30) + zip.readUInt16LE(entry + 32);
  }
  return arrays;
}

// One client's rows, checked as fedsaddle checks a data file: X (rows x features) and y (rows),
// optionally the held-out X_test and y_test; finite numbers; at least one training row.
function readClientData(file) {
  if (!fs.existsSync(file)) throw new Error(`${file}: no such file`);
  const arrays = readNpz(file);
  const { X, y, X_test: XTest, y_test: yTest } = arrays;
  if (!X || !y) throw new Error(`${file}: no array '${X ? 'y' : 'X'}' (found ${Object.keys(arrays)})`);
  if (!XTest !== !yTest) throw new Error(`${file}: X_test and y_test go together`);
  if (X.dims.length !== 2 || !X.dims[0] || !X.dims[1]) {
    throw new Error(`${file}: X must have rows and feature columns, has shape [${X.dims}]`);
  }
  const [rows, features] = X.dims;
  if (y.dims.length !== 1 || y.dims[0] !== rows) {
    throw new Error(`${file}: y must have one entry per row of X (${rows}), has shape [${y.dims}]`);
  }
  if (XTest && (XTest.dims.length !== 2 || XTest.dims[1] !== features || yTest.dims[0] !== XTest.dims[0])) {
    throw new Error(`${file}: X_test has shape [${XTest.dims}] and y_test [${yTest.dims}], X ${features} features`);
  }
  for (const [name, array] of Object.entries(arrays)) {
    const bad = array.values.findIndex((v) => !Number.isFinite(v));
    if (bad >= 0) throw new Error(`${file}: ${name} holds ${array.values[bad]} (NaN and Inf are refused)`);
  }
  const testRows = XTest ? XTest.dims[0] : 0;
  return { rows, features, X: X.values, t: y.values, testRows, XTest: XTest?.values, tTest: yTest?.values };
}

// ------------------------------------------------------------------------------ linear_regression
// The arithmetic page, "linear_regression": with the m rows u_r of X and their targets t_r,
//   A = X^T X / m,  b = X^T t / m,  f(x, y) = lam/2 |x|^2 - y.(A x - b)/2 - |y|^2/2,
//   G(z) = (lam x - (A y)/2,  y - b/2 + (A x)/2)   (the second block in fedsaddle's order),
// for z = (x, y), x and y of p = features entries each; test_mse is the mean of (x.u - t)^2
// over the held-out rows. Sums run in row order, without BLAS: the answers agree with
// fedsaddle's client to about 1e-15 relative, not bit for bit (docs/explanation/numerics.md).

class LinearRegressionClient {
  constructor(index, file) {
    Object.assign(this, { index, file }, readClientData(file));
    const { rows: m, features: p, X, t } = this;
    this.A = new Float64Array(p * p); // row-major, symmetric
    this.b = new Float64Array(p);
    for (let j = 0; j < p; j++) {
      for (let k = 0; k < p; k++) {
        let sum = 0;
        for (let r = 0; r < m; r++) sum += X[r * p + j] * X[r * p + k];
        this.A[j * p + k] = sum / m;
      }
      let sum = 0;
      for (let r = 0; r < m; r++) sum += X[r * p + j] * t[r];
      this.b[j] = sum / m;
    }
  }

  timesA(v) {
    const p = this.features;
    const out = new Float64Array(p);
    for (let j = 0; j < p; j++) {
      let sum = 0;
      for (let k = 0; k < p; k++) sum += this.A[j * p + k] * v[k];
      out[j] = sum;
    }
    return out;
  }

  gradient(z, lam) {
    const p = this.features;
    const [x, y] = [z.subarray(0, p), z.subarray(p)];
    const [Ax, Ay] = [this.timesA(x), this.timesA(y)];
    const g = new Float64Array(2 * p);
    for (let j = 0; j < p; j++) g[j] = lam * x[j] - Ay[j] / 2;
    for (let j = 0; j < p; j++) g[p + j] = y[j] - this.b[j] / 2 + Ax[j] / 2;
    return g;
  }

  objective(z, lam) {
    const p = this.features;
    const [x, y] = [z.subarray(0, p), z.subarray(p)];
    const Ax = this.timesA(x);
    let [xx, yResidual, yy] = [0, 0, 0];
    for (let j = 0; j < p; j++) {
      xx += x[j] * x[j];
      yResidual += y[j] * (Ax[j] - this.b[j]);
      yy += y[j] * y[j];
    }
    return (lam / 2) * xx - yResidual / 2 - yy / 2;
  }

  testMse(z) {
    const p = this.features;
    let sum = 0;
    for (let r = 0; r < this.testRows; r++) {
      let prediction = 0;
      for (let j = 0; j < p; j++) prediction += this.XTest[r * p + j] * z[j];
      const residual = prediction - this.tTest[r];
      sum += residual * residual;
    }
    return sum / this.testRows;
  }
}

// The arithmetic page, "LOCAL_STEPS": from z_0 = z~, step j has the weight w_k (k = step_offset + j),
// the direction g_j = G(z_j) (NONE) or G(z_j) - G(z~) + theta (z_j - z~) + c (SCAFFOLD), and moves
// z_{j+1} = z_j - (gamma_l w_k) g_j. The answer is sum_j w_k g_j, not the last iterate.
function localSteps(client, lam, local, start, control) {
  const n = start.length;
  const z = Float64Array.from(start);
  const answer = new Float64Array(n);
  const gradientAtStart = control ? client.gradient(start, lam) : null;
  for (let j = 0; j < local.steps; j++) {
    const k = local.step_offset + j;
    const weight = local.decay === 'INVERSE_SQRT' ? 1 / (Math.sqrt(k) + 1) : 1;
    const g = client.gradient(z, lam);
    if (control) {
      for (let e = 0; e < n; e++) {
        g[e] -= gradientAtStart[e];
        if (local.theta !== 0) g[e] += local.theta * (z[e] - start[e]);
        g[e] += control[e];
      }
    }
    const step = local.gamma_local * weight;
    for (let e = 0; e < n; e++) {
      answer[e] += weight * g[e];
      z[e] -= step * g[e];
    }
  }
  return answer;
}

// ------------------------------------------------------------------------------ vectors
// The arithmetic page, "Vectors": float64 entries, little-endian, one after the other.

function decodeVector(bytes, count) {
  const out = new Float64Array(count);
  for (let k = 0; k < count; k++) out[k] = bytes.readDoubleLE(8 * k);
  return out;
}

function encodeVectors(vectors) {
  const bytes = Buffer.alloc(8 * vectors.reduce((n, v) => n + v.length, 0));
  let offset = 0;
  for (const v of vectors) for (const entry of v) offset = bytes.writeDoubleLE(entry, offset);
  return bytes;
}

// ------------------------------------------------------------------------------ the session

// The coordinator asked for something this process does not serve, or broke the protocol:
// the session ends with a Failure saying why.
class Refused extends Error {}

function must(condition, reason) {
  if (!condition) throw new Refused(reason);
}

class Session {
  constructor(call, options) {
    this.call = call;
    this.options = options;
    this.clients = null; // a LinearRegressionClient per hosted index, read at the first run
    this.welcome = null;
    this.run = null; // { runId, lam, dimension } of the run under way
    this.roundId = 0; // the task being served
    this.pending = null; // a task whose payload is still arriving in Chunks
    this.exitCode = 1;
    this.ending = false;
  }

  log(message) {
    console.error(`fedsaddle-node [${this.options.indices}] ${message}`);
  }

  send(message) {
    this.call.write(message);
  }

  hello() {
    const { indices, name } = this.options;
    this.send({ hello: { protocol_version: 'PROTOCOL_VERSION_2', client_indices: indices, client_name: name } });
  }

  // A half-close: the coordinator then ends the call, and its status ends the process.
  end(exitCode, why) {
    if (this.ending) return;
    this.ending = true;
    this.exitCode = exitCode;
    this.log(why);
    this.call.end();
    const patience = setTimeout(() => {
      this.log('the coordinator did not end the call within 5 s');
      this.call.cancel();
    }, 5000);
    patience.unref();
  }

  receive(instruction) {
    if (this.ending) return;
    const kind = instruction.body;
    try {
      must(kind === 'welcome' || this.welcome, `the coordinator sent a ${kind} before its Welcome`);
      if (kind === 'welcome') this.onWelcome(instruction.welcome);
      else if (kind === 'run') this.onRun(instruction.run);
      else if (kind === 'task') this.onTask(instruction.task);
      else if (kind === 'chunk') this.onChunk(instruction.chunk);
      else if (kind === 'rejected') this.onRejected(instruction.rejected);
      else if (kind === 'goodbye') this.onGoodbye(instruction.goodbye);
      else must(false, `this client does not serve '${kind}' instructions (it does no secure aggregation)`);
    } catch (error) {
      if (!(error instanceof Refused)) this.log(error.stack);
      const reason = error instanceof Refused ? error.message : `client ${this.options.indices}: ${error.message}`;
      this.send({ failure: { run_id: this.run ? this.run.runId : '', round_id: this.roundId, reason } });
      this.end(1, `stopped: ${reason}`);
    }
  }

  onWelcome(welcome) {
    must(!this.welcome, 'the coordinator sent a second Welcome');
    const { chunk_bytes: chunkBytes, num_clients: n } = welcome;
    must(chunkBytes >= 1024 && chunkBytes <= 67108864, `Welcome.chunk_bytes ${chunkBytes} is outside 1 KiB to 64 MiB`);
    const outside = this.options.indices.filter((i) => i >= n);
    must(!outside.length, `client indices [${outside}] are not below n = ${n}`);
    this.welcome = welcome;
    this.log(`joined ${welcome.federation_id}: ${n} clients`);
  }

  // A run this process cannot serve is refused through Ready.error: the coordinator then ends
  // the run before its first round, naming this client (the arithmetic page, "Limits and manners").
  onRun(spec) {
    this.run = null;
    this.pending = null;
    this.roundId = 0;
    const ready = {
      run_id: spec.run_id,
      numeric_stack: `node ${process.version}, plain JavaScript loops, no BLAS`,
    };
    const refusal = this.refusal(spec);
    if (refusal) {
      this.log(`refusing run ${spec.run_id}: ${refusal}`);
      this.send({ ready: { ...ready, error: refusal } });
      return;
    }
    const dimension = 2 * this.clients[0].features;
    this.run = { runId: spec.run_id, lam: JSON.parse(spec.problem_json).lam, dimension };
    const counts = spec.want_sample_counts ? this.clients.map((c) => c.rows) : [];
    this.send({ ready: { ...ready, dimension, sample_counts: counts } });
    this.log(`serving run ${spec.run_id}: linear_regression, dimension ${dimension}`);
  }

  refusal(spec) {
    if (spec.problem_name !== 'linear_regression') {
      return `this client serves linear_regression only, not '${spec.problem_name}'`;
    }
    if (spec.gradient_noise !== 0) return 'this client computes exact gradients only';
    if (spec.secure_aggregation) return 'this client does no secure aggregation';
    if (spec.dp) return 'this client does no differential privacy';
    if (spec.computations.length) return `this client has no local computation '${spec.computations[0]}'`;
    let problem;
    try {
      problem = JSON.parse(spec.problem_json);
    } catch (error) {
      return `RunSpec.problem_json is not JSON: ${error.message}`;
    }
    if (!(problem.lam > 0 && Number.isFinite(problem.lam))) return `lam is ${problem.lam}, not a number > 0`;
    if (!this.clients) {
      try {
        this.clients = this.options.indices.map((i, k) => new LinearRegressionClient(i, this.options.files[k]));
      } catch (error) {
        return error.message;
      }
    }
    const other = this.clients.find((c) => c.features !== problem.features);
    if (other) {
      return `client ${other.index}: ${other.file} has ${other.features} features, the problem's ${problem.features}`;
    }
    return null;
  }

  onTask(task) {
    must(!this.pending, `task ${task.round_id} came before the chunks of task ${this.roundId} were complete`);
    this.roundId = task.round_id;
    must(this.run && task.run_id === this.run.runId, `a task of run '${task.run_id}', which is not under way`);
    const bytes = 8 * task.payload_length;
    if (task.payload.length === bytes) return this.serve(task, task.payload);
    must(!task.payload.length, `a task declares payload_length ${task.payload_length} (${bytes} bytes) ` +
      `but carries an inline payload of ${task.payload.length} bytes`);
    this.pending = { task, payload: Buffer.alloc(bytes), received: 0 };
  }

  // Chunks come in order, without gaps; each but the last holds at least 4096 bytes (or chunk_bytes).
  onChunk(chunk) {
    const pending = this.pending;
    must(pending, 'a Chunk without a Task before it');
    const end = pending.received + chunk.data.length;
    const total = pending.payload.length;
    must(chunk.offset === pending.received, `a chunk at offset ${chunk.offset}, expected ${pending.received}`);
    must(end <= total, `a chunk overruns the payload of ${total} bytes`);
    must(end === total || chunk.data.length >= Math.min(4096, this.welcome.chunk_bytes),
      `a chunk of ${chunk.data.length} bytes before the last`);
    chunk.data.copy(pending.payload, pending.received);
    pending.received = end;
    if (end === total) {
      this.pending = null;
      this.serve(pending.task, pending.payload);
    }
  }

  serve(task, payload) {
    const { lam, dimension } = this.run;
    // The task's clients, in its order; none named means all of this session's, in Hello order.
    const indices = task.client_indices.length ? task.client_indices : this.options.indices;
    const clients = indices.map((i) => this.clients.find((c) => c.index === i));
    must(clients.every(Boolean), `task ${task.round_id} names clients [${indices}]; this process hosts others`);
    const length = (entries) => must(task.payload_length === entries,
      `a ${task.kind} task of ${task.payload_length} entries; ${entries} expected`);
    const answer = { run_id: task.run_id, round_id: task.round_id, client_indices: indices };
    let rows;
    let objective = [];
    if (task.kind === 'GRADIENT') {
      // No gradient noise in a run served here: the mean of `batch` estimates is G_i(z) itself.
      length(dimension);
      const z = decodeVector(payload, dimension);
      rows = clients.map((c) => c.gradient(z, lam));
      if (task.gradient?.want_objective) objective = clients.map((c) => c.objective(z, lam));
    } else if (task.kind === 'LOCAL_STEPS') {
      const local = task.local;
      must(['NONE', 'SCAFFOLD'].includes(local.correction), `unknown correction ${local.correction}`);
      must(['CONSTANT', 'INVERSE_SQRT'].includes(local.decay), `unknown step decay ${local.decay}`);
      for (const name of ['gamma_local', 'theta']) {
        must(Number.isFinite(local[name]) && local[name] >= 0, `LocalSteps.${name} is ${local[name]}, not >= 0`);
      }
      const scaffold = local.correction === 'SCAFFOLD';
      length(scaffold ? 2 * dimension : dimension);
      const vectors = decodeVector(payload, task.payload_length);
      const [start, control] = [vectors.subarray(0, dimension), scaffold ? vectors.subarray(dimension) : null];
      rows = clients.map((c) => localSteps(c, lam, local, start, control));
    } else if (task.kind === 'EVALUATE') {
      must(task.metric_names.join() === 'test_mse', `metrics [${task.metric_names}] are not linear_regression's`);
      length(dimension);
      const z = decodeVector(payload, dimension);
      // A client whose test_mse is undefined (no held-out rows) or overflowed answers 0 with a
      // count of 0, as fedsaddle's client does (a NaN would be refused).
      const values = clients.map((c) => (c.testRows ? c.testMse(z) : NaN));
      rows = values.map((value) => [Number.isFinite(value) ? value : 0]);
      answer.sample_counts = clients.map((c, k) => (Number.isFinite(values[k]) ? c.testRows : 0));
    } else if (task.kind === 'COMPUTE') {
      must(false, `this client has no local computation '${task.compute?.name}'`);
    } else {
      must(false, `unknown task kind ${task.kind}`);
    }
    // A step size too large overflows: the answer then says the run diverged, with an empty payload
    // (the arithmetic page, "Vectors": non-finite values are refused).
    if (!rows.every((row) => row.every(Number.isFinite)) || !objective.every(Number.isFinite)) {
      return this.send({ answer: { ...answer, diverged: true } });
    }
    if (objective.length) answer.objective = encodeVectors([objective]);
    this.sendAnswer(answer, encodeVectors(rows));
  }

  // Inline when the payload fits in chunk_bytes, else an Answer with an empty payload, then Chunks.
  sendAnswer(answer, payload) {
    const chunkBytes = this.welcome.chunk_bytes;
    const header = { ...answer, payload_length: payload.length / 8 };
    if (payload.length <= chunkBytes) return this.send({ answer: { ...header, payload } });
    this.send({ answer: header });
    for (let offset = 0; offset < payload.length; offset += chunkBytes) {
      this.send({ chunk: { offset, data: payload.subarray(offset, offset + chunkBytes) } });
    }
  }

  onRejected(rejected) {
    this.log(`round ${rejected.round_id}: answer refused: ${rejected.code}: ${rejected.details}`);
  }

  onGoodbye(goodbye) {
    if (goodbye.outcome === 'DONE') this.end(0, `done: ${goodbye.reason}`);
    else this.end(1, `the coordinator ended the federation: ${goodbye.reason}`);
  }
}

// ------------------------------------------------------------------------------ main

function main() {
  const options = parseCommandLine(process.argv.slice(2));
  // uint64 fields are read as Numbers: exact below 2^53, as every count, round and length is.
  // noise_seed may be larger, but this client draws no noise and never reads it.
  const loaderOptions = { keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true };
  const { Coordinator } = grpc.loadPackageDefinition(protoLoader.loadSync(options.proto, loaderOptions)).fedsaddle.v2;
  // A message is at most chunk_bytes + 1 MiB, and chunk_bytes (up to 64 MiB) comes in the
  // Welcome, on a channel already open: so allow 64 MiB + 1 MiB each way from the start.
  const limit = 64 * 1024 * 1024 + 1024 * 1024;
  const channelOptions = { 'grpc.max_receive_message_length': limit, 'grpc.max_send_message_length': limit };
  const stub = new Coordinator(options.coordinator, grpc.credentials.createInsecure(), channelOptions);
  stub.waitForReady(Date.now() + 1000 * options.connectTimeout, (error) => {
    if (error) {
      console.error(`fedsaddle-node [${options.indices}] cannot reach the coordinator at ${options.coordinator} ` +
        `within ${options.connectTimeout} s: ${error.message}`);
      stub.close();
      process.exitCode = 1;
      return;
    }
    const call = stub.Session();
    const session = new Session(call, options);
    call.on('data', (instruction) => session.receive(instruction));
    call.on('error', () => {}); // reported by 'status', which follows
    call.on('status', (status) => {
      if (status.code !== grpc.status.OK) {
        session.log(`the session ended: ${grpc.status[status.code]}: ${status.details}`);
        session.exitCode = 1;
      } else if (!session.ending) {
        session.log('the coordinator ended the session without a goodbye');
        session.exitCode = 1;
      }
      stub.close();
      process.exitCode = session.exitCode;
    });
    session.hello();
  });
}

main();
