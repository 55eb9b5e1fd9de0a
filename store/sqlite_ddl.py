"""GENERATED from store/schema.py by `python -m graphdeck.store.migrate --write-sqlite-ddl`; do not edit
(tests/test_import_lite.py fails when it is stale). What a new SQLite store is made of when it is
created without SQLAlchemy: NOTE: [SQLite store without SQLAlchemy] in store/lite.py."""

SCHEMA_VERSION = 6
REVISION = '0006'
DDL = ('CREATE TABLE runs (\n'
 '\tid INTEGER NOT NULL, \n'
 '\tname VARCHAR(200) NOT NULL, \n'
 '\tworld_size INTEGER, \n'
 '\tcreated_at DATETIME NOT NULL, \n'
 '\tmeta_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (name)\n'
 ')',
 'CREATE TABLE store_meta (\n'
 '\t"key" VARCHAR(64) NOT NULL, \n'
 '\tvalue TEXT NOT NULL, \n'
 '\tPRIMARY KEY ("key")\n'
 ')',
 'CREATE TABLE strings (\n'
 '\tid INTEGER NOT NULL, \n'
 '\tvalue TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (value)\n'
 ')',
 'CREATE TABLE compile_events (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tname VARCHAR(100) NOT NULL, \n'
 '\tcompile_id VARCHAR(64), \n'
 '\tmetadata_json TEXT NOT NULL, \n'
 '\tpayload TEXT, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_compile_events_run_id ON compile_events (run_id)',
 'CREATE INDEX ix_compile_events_run_rank_name ON compile_events (run_id, rank, name)',
 'CREATE TABLE grad_steps (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tstep_first INTEGER NOT NULL, \n'
 '\tstep_last INTEGER NOT NULL, \n'
 '\tn_backward INTEGER NOT NULL, \n'
 '\tstep_source VARCHAR(16) NOT NULL, \n'
 '\tclosed BOOLEAN NOT NULL, \n'
 '\tstate_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_grad_steps_run_rank ON grad_steps (run_id, rank)',
 'CREATE TABLE graphs (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tordinal INTEGER NOT NULL, \n'
 '\tkind VARCHAR(32) NOT NULL, \n'
 '\tname VARCHAR(300) NOT NULL, \n'
 '\tcompile_id VARCHAR(64), \n'
 '\tframe_name VARCHAR(300), \n'
 '\tparent_id INTEGER, \n'
 '\tpartition_index INTEGER, \n'
 '\tnum_nodes INTEGER NOT NULL, \n'
 '\tstructural_hash VARCHAR(64), \n'
 '\tcompile_time_s FLOAT, \n'
 '\tbackend VARCHAR(64), \n'
 '\tbreak_reason TEXT, \n'
 '\tcode TEXT, \n'
 '\tmeta_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(parent_id) REFERENCES graphs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_graphs_run_rank ON graphs (run_id, rank)',
 'CREATE TABLE params (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tfqn VARCHAR(500) NOT NULL, \n'
 '\tkind VARCHAR(16) NOT NULL, \n'
 '\tstorage_key VARCHAR(64) NOT NULL, \n'
 '\tshape_json TEXT NOT NULL, \n'
 '\tdtype VARCHAR(32) NOT NULL, \n'
 '\tnumel BIGINT NOT NULL, \n'
 '\tsize_bytes BIGINT NOT NULL, \n'
 '\trequires_grad BOOLEAN NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (run_id, rank, fqn), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_params_run_id ON params (run_id)',
 'CREATE TABLE ranks (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tworld_size INTEGER NOT NULL, \n'
 '\thostname VARCHAR(200), \n'
 '\tpid INTEGER, \n'
 '\tbackend VARCHAR(32), \n'
 '\ttorch_version VARCHAR(64), \n'
 '\tstarted_at DATETIME NOT NULL, \n'
 '\tmeta_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (run_id, rank), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_ranks_run_id ON ranks (run_id)',
 'CREATE TABLE traces (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tname VARCHAR(300) NOT NULL, \n'
 '\tstatus VARCHAR(16) NOT NULL, \n'
 '\tnum_events INTEGER NOT NULL, \n'
 '\tstart_ns BIGINT, \n'
 '\tend_ns BIGINT, \n'
 '\tcreated_at DATETIME NOT NULL, \n'
 '\tstats_json TEXT NOT NULL, \n'
 '\tmeta_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_traces_run_id ON traces (run_id)',
 'CREATE TABLE edges (\n'
 '\tid INTEGER NOT NULL, \n'
 '\tgraph_id INTEGER NOT NULL, \n'
 '\tsrc_idx INTEGER NOT NULL, \n'
 '\tdst_idx INTEGER NOT NULL, \n'
 '\targ_pos INTEGER NOT NULL, \n'
 '\tsize_bytes BIGINT, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(graph_id) REFERENCES graphs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_edges_graph_id ON edges (graph_id)',
 'CREATE TABLE graph_io (\n'
 '\tid INTEGER NOT NULL, \n'
 '\tgraph_id INTEGER NOT NULL, \n'
 '\tdirection VARCHAR(8) NOT NULL, \n'
 '\tposition INTEGER NOT NULL, \n'
 '\tnode_name VARCHAR(300), \n'
 '\tparam_fqn VARCHAR(500), \n'
 '\thas_grad BOOLEAN, \n'
 '\t"desc" TEXT, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(graph_id) REFERENCES graphs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_graph_io_graph_id ON graph_io (graph_id)',
 'CREATE TABLE kernel_nodes (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tcompile_id VARCHAR(64), \n'
 '\tgraph_id INTEGER, \n'
 '\tkernel_name VARCHAR(500) NOT NULL, \n'
 '\tnode_name VARCHAR(300) NOT NULL, \n'
 '\tpre_grad_node VARCHAR(300), \n'
 '\tsource VARCHAR(32) NOT NULL, \n'
 '\tcall_index INTEGER, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(graph_id) REFERENCES graphs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_kernel_nodes_graph_id ON kernel_nodes (graph_id)',
 'CREATE INDEX ix_kernel_nodes_run_kernel ON kernel_nodes (run_id, kernel_name)',
 'CREATE TABLE node_time_sets (\n'
 '\tid INTEGER NOT NULL, \n'
 '\ttrace_id INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tmethod VARCHAR(64) NOT NULL, \n'
 '\tsource VARCHAR(64), \n'
 '\tsteps INTEGER NOT NULL, \n'
 '\tmapped_calls INTEGER NOT NULL, \n'
 '\tunmapped_calls INTEGER NOT NULL, \n'
 '\tmissing TEXT, \n'
 '\tgraphs_count INTEGER NOT NULL, \n'
 '\tlast_graph_id INTEGER, \n'
 '\tkernel_nodes_count INTEGER NOT NULL, \n'
 '\tcreated_at DATETIME NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (trace_id, method), \n'
 '\tFOREIGN KEY(trace_id) REFERENCES traces (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(last_graph_id) REFERENCES graphs (id) ON DELETE SET NULL\n'
 ')',
 'CREATE INDEX ix_node_time_sets_run_id ON node_time_sets (run_id)',
 'CREATE TABLE nodes (\n'
 '\tid INTEGER NOT NULL, \n'
 '\tgraph_id INTEGER NOT NULL, \n'
 '\tidx INTEGER NOT NULL, \n'
 '\tname VARCHAR(300) NOT NULL, \n'
 '\top VARCHAR(32) NOT NULL, \n'
 '\ttarget_id INTEGER NOT NULL, \n'
 '\targs_json TEXT NOT NULL, \n'
 '\tshape_json TEXT, \n'
 '\tdtype VARCHAR(32), \n'
 '\tstride_json TEXT, \n'
 '\tdevice VARCHAR(32), \n'
 '\tsize_bytes BIGINT, \n'
 '\tmodule_path_id INTEGER, \n'
 '\tmodule_stack_json TEXT, \n'
 '\tstack_trace_id INTEGER, \n'
 '\tseq_nr INTEGER, \n'
 '\tpartitioner_tag VARCHAR(64), \n'
 '\t"desc" TEXT, \n'
 '\tparam_fqn VARCHAR(500), \n'
 '\tmeta_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (graph_id, idx), \n'
 '\tFOREIGN KEY(graph_id) REFERENCES graphs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(target_id) REFERENCES strings (id), \n'
 '\tFOREIGN KEY(module_path_id) REFERENCES strings (id), \n'
 '\tFOREIGN KEY(stack_trace_id) REFERENCES strings (id)\n'
 ')',
 'CREATE INDEX ix_nodes_graph_id ON nodes (graph_id)',
 'CREATE TABLE partitions (\n'
 '\tid INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tkind VARCHAR(32) NOT NULL, \n'
 '\tparent_graph_id INTEGER, \n'
 '\tgraph_id INTEGER, \n'
 '\t"index" INTEGER NOT NULL, \n'
 '\tsize_bytes BIGINT NOT NULL, \n'
 '\tparams_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(parent_graph_id) REFERENCES graphs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(graph_id) REFERENCES graphs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_partitions_run_id ON partitions (run_id)',
 'CREATE TABLE trace_events (\n'
 '\tid INTEGER NOT NULL, \n'
 '\ttrace_id INTEGER NOT NULL, \n'
 '\tph VARCHAR(2) NOT NULL, \n'
 '\tname_id INTEGER NOT NULL, \n'
 '\tcat_id INTEGER, \n'
 '\tts_ns BIGINT NOT NULL, \n'
 '\tdur_ns BIGINT NOT NULL, \n'
 '\tpid VARCHAR(64) NOT NULL, \n'
 '\ttid VARCHAR(64) NOT NULL, \n'
 '\tcorrelation BIGINT, \n'
 '\targs_json TEXT, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(trace_id) REFERENCES traces (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(name_id) REFERENCES strings (id), \n'
 '\tFOREIGN KEY(cat_id) REFERENCES strings (id)\n'
 ')',
 'CREATE INDEX ix_trace_events_trace_ts ON trace_events (trace_id, ts_ns)',
 'CREATE TABLE trace_links (\n'
 '\tid INTEGER NOT NULL, \n'
 '\ttrace_id INTEGER NOT NULL, \n'
 '\trun_id INTEGER NOT NULL, \n'
 '\trank INTEGER NOT NULL, \n'
 '\tmethod VARCHAR(64) NOT NULL, \n'
 '\tgraphs_count INTEGER NOT NULL, \n'
 '\tlast_graph_id INTEGER, \n'
 '\tkernel_nodes_count INTEGER NOT NULL, \n'
 '\tevents_count INTEGER NOT NULL, \n'
 '\tfirst_event_id BIGINT, \n'
 '\tlast_event_id BIGINT, \n'
 '\tlinks_json TEXT NOT NULL, \n'
 '\tcreated_at DATETIME NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tUNIQUE (trace_id, method), \n'
 '\tFOREIGN KEY(trace_id) REFERENCES traces (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(run_id) REFERENCES runs (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(last_graph_id) REFERENCES graphs (id) ON DELETE SET NULL\n'
 ')',
 'CREATE INDEX ix_trace_links_run_id ON trace_links (run_id)',
 'CREATE TABLE node_times (\n'
 '\tid INTEGER NOT NULL, \n'
 '\tset_id INTEGER NOT NULL, \n'
 '\tgraph_id INTEGER NOT NULL, \n'
 '\tnode_name VARCHAR(300) NOT NULL, \n'
 '\ttotal_ns BIGINT NOT NULL, \n'
 '\tcount INTEGER NOT NULL, \n'
 '\tsteps_ns_json TEXT NOT NULL, \n'
 '\tPRIMARY KEY (id), \n'
 '\tFOREIGN KEY(set_id) REFERENCES node_time_sets (id) ON DELETE CASCADE, \n'
 '\tFOREIGN KEY(graph_id) REFERENCES graphs (id) ON DELETE CASCADE\n'
 ')',
 'CREATE INDEX ix_node_times_graph_id ON node_times (graph_id)',
 'CREATE INDEX ix_node_times_set ON node_times (set_id)',
 'CREATE TABLE alembic_version (\n'
 '\tversion_num VARCHAR(32) NOT NULL, \n'
 '\tCONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)\n'
 ')')
DEFAULTS = {'compile_events': {'metadata_json': '{}'},
 'edges': {'arg_pos': 0},
 'grad_steps': {'closed': False, 'n_backward': 1, 'state_json': '{}', 'step_source': 'backward'},
 'graphs': {'meta_json': '{}', 'num_nodes': 0},
 'node_time_sets': {'created_at': '<now>',
                    'graphs_count': 0,
                    'kernel_nodes_count': 0,
                    'mapped_calls': 0,
                    'steps': 1,
                    'unmapped_calls': 0},
 'node_times': {'count': 0, 'steps_ns_json': '[]', 'total_ns': 0},
 'nodes': {'args_json': '[]', 'meta_json': '{}'},
 'partitions': {'kind': 'ddp_bucket', 'params_json': '[]', 'size_bytes': 0},
 'ranks': {'meta_json': '{}', 'started_at': '<now>', 'world_size': 1},
 'runs': {'created_at': '<now>', 'meta_json': '{}'},
 'trace_events': {'dur_ns': 0},
 'trace_links': {'created_at': '<now>',
                 'events_count': 0,
                 'graphs_count': 0,
                 'kernel_nodes_count': 0,
                 'links_json': '{}'},
 'traces': {'created_at': '<now>', 'meta_json': '{}', 'num_events': 0, 'stats_json': '{}', 'status': 'ok'}}
